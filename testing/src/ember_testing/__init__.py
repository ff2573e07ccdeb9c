"""Private test helpers of the Ember monorepo (never published): the tiny-model factory
(``ember_testing.tiny_models``) and the pytest fixtures over it."""
