"""Programs built on the engine, the server and the launchers: demo, generate, loadtest."""
