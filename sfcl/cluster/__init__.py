"""Scale-out on Ray Serve: ``sfcl serve --replicas N`` (extra ``sfcl[ray]``).

One endpoint, N engine replicas, requests routed by prefix-cache affinity::

    client --HTTP--> Serve proxy --> SfclIngress (create_app over ClusterEngine; tokenizes, hashes)
                                        |  DeploymentHandle.options(stream=True), PrefixAffinityRouter
                                        v
                      EngineReplica x N (AsyncEngine each)  --reports-->  ReportHub --> /health, /metrics

Modules: ``config`` (ClusterConfig, deployment options; no Ray), ``affinity`` (the routing rule;
no Ray), ``reports`` (replica info and reports, metric merging; no Ray), ``router`` (Serve
``RequestRouter``), ``replica`` (engine replica and report hub deployments), ``ingress``
(``ClusterEngine`` and the ingress deployment), ``app`` (the Serve application, also as an import
path for KubeRay), ``launch`` (the CLI's run loop). Only ``config``, ``affinity`` and ``reports``
import without Ray installed.
"""
