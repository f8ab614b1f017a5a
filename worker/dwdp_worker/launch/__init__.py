"""Entry points: the CLI, the local launcher, the pod entrypoint, the env contract parser, the demo. README.md."""
