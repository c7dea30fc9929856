"""Vision-language policies (Qwen2-VL / Qwen2.5-VL family): tiny offline builds for tests and CPU runs."""
