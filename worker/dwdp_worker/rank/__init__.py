"""A rank process: the engine that runs packed prefills on one device, its protocol with the front. README.md."""
