"""The speculative decoding engine: one step for any width, the policy that picks k, proposers, the verifier."""
