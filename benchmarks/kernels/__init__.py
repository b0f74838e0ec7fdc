"""One benchmark script per kernel family; each times fuselane and its peers in one process."""
