"""Chat templates of two families, for the toy target and for tests of the loss mask.

The toy target uses the Llama-3 family (header tokens, `<|eot_id|>` ends a turn). ChatML (`<|im_start|>`,
`<|im_end|>`, Qwen's family) is the second family the tokenisation is tested on. Both are the plain forms of
those families: no tool calls, no reasoning blocks.
"""

from __future__ import annotations

LLAMA3_SPECIAL_TOKENS = {
    "bos": "<|begin_of_text|>",
    "eos": "<|end_of_text|>",
    "eot": "<|eot_id|>",
    "header_start": "<|start_header_id|>",
    "header_end": "<|end_header_id|>",
    "pad": "<|finetune_right_pad_id|>",
}

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

CHATML_SPECIAL_TOKENS = {
    "eos": "<|im_end|>",
    "im_start": "<|im_start|>",
    "pad": "<|endoftext|>",
}

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
