"""A stand-in for the one vLLM module SGLang's RoPE imports on a machine without CUDA (`vllm._custom_ops`, in
srt/layers/rotary_embedding/base.py): the conformance suite builds SGLang's drafter to load weights into it and
never runs a kernel."""
