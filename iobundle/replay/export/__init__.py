"""replay's export room (its public face comes in the next commit)."""
