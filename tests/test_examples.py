"""The README's code is the examples' code (examples/), and every example trains, at small
scale, launched as the README says (``make examples-check`` runs them at full scale)."""

import json
import os
import re
import sys
from pathlib import Path

import pytest
from launch import finish, spawn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import run  # noqa: E402  (examples/run.py: how each example is launched)

REGION = re.compile(r"^[ \t]*# \[readme\]\n(.*?)^[ \t]*# \[/readme\]\n", re.S | re.M)
BLOCK = re.compile(r"^```python\n(.*?)^```\n", re.S | re.M)
SMALL = ("--steps", "8", "--batch", "16", "--test-images", "2000")


def _dedented(text: str) -> str:
    lines = text.splitlines()
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[indent:] for line in lines) + "\n"


def readme_blocks() -> list[str]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def example_regions() -> dict[str, str]:
    """``{region: example file}`` of every ``# [readme]`` region of examples/."""
    return {
        _dedented(region): path.name
        for path in sorted((ROOT / "examples").glob("*.py"))
        for region in REGION.findall(path.read_text())
    }


def test_every_python_block_of_the_readme_is_an_examples_code():
    regions = example_regions()
    missing = [block for block in readme_blocks() if block not in regions]
    assert not missing, "README blocks that are no example's [readme] region:\n" + "\n---\n".join(missing)
    shown = set(readme_blocks())
    unshown = [f"{name}:\n{region}" for region, name in regions.items() if region not in shown]
    assert not unshown, "examples' [readme] regions the README does not show:\n" + "\n---\n".join(unshown)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """``small_run(example)``: the example's result at small scale, launched once per module."""
    results: dict[str, dict] = {}

    def result(example: str) -> dict:
        if example not in results:
            if run.EXAMPLES[example][0] == "horovodrun" and os.environ.get("LAGS_TESTS_WITHOUT_HOROVOD"):
                pytest.skip("LAGS_TESTS_WITHOUT_HOROVOD is set: Horovod's launches are skipped")
            out = tmp_path_factory.mktemp(example) / "result.json"
            command = [*run.command(example), *SMALL, "--out", str(out)]
            finish(spawn(command, run.environment(), cwd=out.parent), timeout=180)
            results[example] = json.loads(out.read_text())
        return results[example]

    return result


# accelerate_hook runs as accelerate_hook-accumulate4 (the same script, accumulating); dense_ddp is
# make examples-check's reference, not a README block
@pytest.mark.parametrize("example", [name for name in run.EXAMPLES if name not in ("accelerate_hook", "dense_ddp")])
def test_the_example_trains_launched_as_the_readme_says(small_run, example):
    result = small_run(example)
    assert result["steps"] == 8 and result["test_images"] == 2000
    assert result["accuracy"] > 0.2  # 8 steps of 2 x 16 images: well above chance


def test_the_checkpoint_example_resumes_bit_for_bit(small_run):
    """Half the steps, saved on rank 0, loaded by a fresh model and optimizer on every rank, the
    other half: the same model (the same test accuracy, to the image) as the straight run."""
    assert small_run("checkpoint_rank0")["accuracy"] == small_run("horovod_drop_in")["accuracy"]
