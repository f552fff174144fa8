"""Engine I/O in one place: the SGLang server's lifecycle (sglang_server), its capture hooks (sglang_capture) and
the architecture table they follow (sglang_models), the SGLang benchmark client (sglang_client), the
OpenAI-compatible regeneration client (openai_client), all over one HTTP client (http). The hidden-state
backends that read through them stay in targets/."""
