"""A CUDA graph's stand-in off CUDA, so that ``cuda_graphs=True`` runs its capture path on the
CPU: the tests of lags_hvd.capture and the workers' scenarios with graphs use it."""

from lags_hvd import capture


def replayed_in_place(run, inputs, device):
    """``capture.cuda_graph``'s stand-in: ``run`` once now (the capture's run), then again at
    every replay, on the replay's inputs, which must lie where the capture's did, with the
    same shapes, strides and dtypes (what a graph reads). Every run returns the same
    tensors, rewritten (what a graph's replay does); it holds no input."""
    where, outputs = layouts(inputs), run(*inputs)

    def replay(*now):
        assert layouts(now) == where, "a graph replayed on inputs that are not where it read them"
        again = run(*now)
        assert all(a is b for a, b in zip(again, outputs))
        return again

    return replay, outputs


def layouts(tensors) -> list:
    return [None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors]


def install(set_attribute=setattr) -> None:
    """Every device capturable, through the stand-in (``monkeypatch.setattr`` undoes it
    after a test; a worker keeps it)."""
    set_attribute(capture, "capturable", lambda device: True)
    set_attribute(capture, "cuda_graph", replayed_in_place)
