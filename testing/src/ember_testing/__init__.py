"""Private test helpers of the Ember monorepo (never published): pytest fixtures over
``ember_worker.tiny_models``."""
