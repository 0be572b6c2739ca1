"""Lazy restore: the lazy-pages daemon and the page checks (lazy), and the jobs whose pages are still
arriving (fetches).

May import pipeline, storage and processes."""
