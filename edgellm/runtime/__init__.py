"""edgellm.runtime."""
