"""Prompt text without a model: FIM templates and trimming, detokenizing, stops and phrases."""
