"""What both SQL stores share, written once: the operations, row mapping, stats, option and name
checks, and the loader of their named-block ``queries.sql`` files.

Each store keeps only its dialect: the SQL (one ``queries.sql`` per store, the same statement
names and parameters), transaction handling, connections, and the table that maps its driver's
errors to outboxkit's. No driver is imported here.
"""
