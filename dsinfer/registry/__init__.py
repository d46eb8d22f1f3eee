"""Several models and versions in one server: the store, weighted sticky routing, hot swap."""
