"""Admission: handler <- completion <- transport <- instrumentation, in app, served by server."""
