"""horovodrun's own command line, its build probe answered by the caller (tests/launch.py).

Before each launch Horovod's launcher forks a child that imports horovod.torch, and with it
torch, only to learn whether Gloo or MPI was built: 2-3 s of two busy cores per launch, a few
hundred launches a run. The suite asks once per process and launches through this file."""

from horovod.runner import launch

launch.gloo_built = launch.mpi_built = lambda verbose=False: True

if __name__ == "__main__":
    launch.run_commandline()
