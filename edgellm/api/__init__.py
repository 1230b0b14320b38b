"""edgellm.api."""
