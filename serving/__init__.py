"""The `fuselane` command line, the Ray Serve canary application and the load generator."""
