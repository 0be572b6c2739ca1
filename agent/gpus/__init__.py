"""GPUs: NVML (gpu), the CUDA driver's checkpoint API (cuda), and the engine step that suspends and resumes a
GPU job around its dump (gpustep).

May import pipeline, storage and processes."""
