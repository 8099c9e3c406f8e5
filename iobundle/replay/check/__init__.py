"""replay's check room (its public face comes in the next commit)."""
