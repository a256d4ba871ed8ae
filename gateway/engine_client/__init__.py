"""How the gateway reaches engines: in-process or over the engine's HTTP service."""
