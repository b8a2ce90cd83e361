"""One libcst transformation per change; each is a pure function from source to source."""
