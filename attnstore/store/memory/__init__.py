"""The in-memory backend of the map store: the interface's twin for tests of other components."""
