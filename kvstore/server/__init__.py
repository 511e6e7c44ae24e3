"""The kvstore daemon's service side: the gRPC servicer over a Store (`servicer`), the
daemon process lifecycle (`daemon`), and Prometheus metrics (`metrics`)."""

from kvstore.server.daemon import Daemon, serve

__all__ = ["Daemon", "serve"]
