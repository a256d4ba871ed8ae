"""loramux: multi-tenant LoRA serving. The repository keeps its packages at the top level
(engine/, gateway/, adapters/, kernels/, cache/, migrations/); each is linked here, so
they install, import and type-check as `loramux.<package>` and nothing generic lands at the
top of site-packages."""
