"""Loaded at start-up by every Python process the suite starts (tests/conftest.py puts this
folder on PYTHONPATH): at exit, after every other atexit handler, the garbage collector's
objects are frozen, so the interpreter's final collections skip the object graph of torch and
its compiler stack. That walk costs 1.5 CPU-s of each process's exit on these machines and runs
none of our code (the optimizer's hook removal is a weakref.finalize, which runs at atexit as
before); everything else about exit is unchanged (atexit handlers, flushing, module teardown,
the exit status). tests/test_exit.py launches without it, to test the exit itself."""

import atexit
import gc

atexit.register(gc.freeze)  # registered first, so it runs last
