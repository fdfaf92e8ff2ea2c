"""The daemon's HTTP layer: the ASGI app that lists every dialect once (`app`), who may
talk to it (`security`), how much (`intake`: body sizes and request rates; `jsonshape`: a
JSON body's values and depth), and the process that serves it (`main`, `pidfile`). It sits
above `llmrun.api` and the service; nothing below imports it."""
