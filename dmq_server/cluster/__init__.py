"""This node among others: ZooKeeper membership and registry, takeover of a dead node's
copies, delay fragments shared among live nodes, nsqlookupd's view of the cluster.
"""
