"""The app factory (`app`), its lifespan (`lifespan`: the models and workers started before
the first request and stopped at exit) and its middleware stack (`middleware_stack`)."""
