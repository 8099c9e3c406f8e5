"""replay's infer room (its public face comes in the next commit)."""
