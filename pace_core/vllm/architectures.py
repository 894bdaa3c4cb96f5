"""The vLLM architectures served with PACE pages (:mod:`pace_core.vllm.models` has one class each); no import, so the
plugin's entry point (:mod:`pace_core.vllm`) stays free of vLLM and of the library."""

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
                 "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM")
