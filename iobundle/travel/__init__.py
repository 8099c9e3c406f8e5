"""Bundles leaving the machine (its public face comes in the next commit)."""
