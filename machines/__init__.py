"""Declared statecharts and the controllers that own them (no cffi)."""
