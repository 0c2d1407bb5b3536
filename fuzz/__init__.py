"""Fuzzers (installed as ``vtoken.fuzz``): stateful machines that hold ``vtoken`` and the
reference model side by side, and the campaign runner."""
