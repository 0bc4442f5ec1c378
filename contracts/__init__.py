"""Pure contracts: attrs value types and rules of the spec (no threads, no cffi)."""
