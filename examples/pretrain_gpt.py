"""Pretrain a megatron-core GPTModel with tensor + sequence parallelism whose linears come from flux_layers (or,
for comparison, from megatron-core), on a learnable synthetic token stream.

    python examples/pretrain_gpt.py                          # all GPUs of the node (or 2 CPU processes), flux linears
    python examples/pretrain_gpt.py --model h8192 --compare  # both implementations back to back, table + JSON + PNG
    torchrun --nproc-per-node 2 examples/pretrain_gpt.py ...  # the same under a launcher

Without a launcher the script starts one process per GPU itself (TP = number of GPUs); without GPUs it starts two
gloo processes on the CPU, runs the tiny config through the reference backend, and its throughput means nothing.
See examples/README.md for the options, the FLOP formula and the checkpoint layout; the code is the package
``examples.gpt``.

Run as a file, Python puts ``examples/`` on the import path, not the repository root, so neither ``examples.gpt``
nor a flux_layers that is not installed can be imported. The file then runs itself again as the module
``examples.pretrain_gpt`` (what ``python -m examples.pretrain_gpt`` from the repository root does), with the
repository root in ``PYTHONPATH``: same interpreter options, arguments, working directory and process id (exec).
"""
import os
import sys

if __name__ == "__main__" and not __package__:
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_root, os.environ.get("PYTHONPATH")) if p))
    _interpreter = sys.orig_argv[:len(sys.orig_argv) - len(sys.argv)]  # the interpreter and its options (-u, -X ...)
    os.execve(sys.executable, [*_interpreter, "-m", "examples.pretrain_gpt", *sys.argv[1:]], _env)

from examples.gpt.pretrain import main  # noqa: E402  (after the re-run above, which never returns)

if __name__ == "__main__":
    sys.exit(main())
