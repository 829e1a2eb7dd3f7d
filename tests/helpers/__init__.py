"""What the test modules share, so that no test module imports another:

    models       tiny checkpoints written by transformers (shapes from tools/model_shapes.py,
                 the registry the GPU check shares) and the engines the tests run on them
    reference    transformers as the reference: greedy tokens, the settings every model is
                 checked under, cbgen's tokens under each
    cli          `cbgen run` in a subprocess: arguments, environment, output read back
    scheduling   the scheduler tests' fake runner, requests and random workloads
    kernels      Triton kernels under the interpreter on the CPU

Fixtures stay in tests/conftest.py, visible to every test folder.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository's root."""
