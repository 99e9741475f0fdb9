"""The experiment harness around the daemon: scenario files, the ``coterie run`` backends that
start a whole network on one machine (processes, in-process, Ray), and the results they write.
The daemon (``coterie.node``) never imports it: a deployed node runs without the harness."""
