"""One solve function, its gradient strategies, and the integration settings a model fixes."""
