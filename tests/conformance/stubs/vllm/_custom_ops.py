"""`rotary_embedding`, as SGLang imports it; it is never called by the conformance suite."""

from typing import NoReturn


def rotary_embedding(*args: object, **kwargs: object) -> NoReturn:
    raise NotImplementedError("the conformance suite's vllm stand-in runs no kernels")
