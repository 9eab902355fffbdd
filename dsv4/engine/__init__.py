"""The serving engine: engine step -> scheduler -> model runner -> model -> sampler; propose -> verify -> accept."""
