"""Operating a job: metrics, the cluster events, `p2pft top`, logging."""
