"""Test support code shared by several test modules (fixtures, fakes, helpers)."""
