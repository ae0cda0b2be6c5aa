"""The OpenAI- and llama.cpp-compatible HTTP edge."""
