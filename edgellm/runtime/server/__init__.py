"""The HTTP face of the node: the FastAPI app, the routes of every dialect, the one generation flow they share,
the HTTP guard, CORS, the console page, Prometheus and systemd readiness. Nothing here runs the model: it talks
to the engine worker through `edgellm.engine.interface.EngineClient`."""
