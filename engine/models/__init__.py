"""Our own compact model code: dense Qwen3, hybrid Qwen3.5/3.6, the DFlash drafter; HF-format loading."""
