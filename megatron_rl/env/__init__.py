"""The deep-search environment: tools (search, visit) whose failures come back labelled."""
