"""Serving Prometheus: the collector over the latest snapshots, the HTTP endpoint and its security, file_sd.

=========================  ======================================================================
``prometheus_exporter.py``  every metric family, from the snapshots (never touches torch)
``http_server.py``          ``/metrics`` over HTTP or HTTPS, bounded, timed out
``endpoint_security.py``    TLS files, mutual TLS, basic-auth users
``file_sd.py``              the target file the job writes for Prometheus and withdraws
=========================  ======================================================================
"""
