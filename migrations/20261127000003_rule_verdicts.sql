-- Each rule's verdicts per minute (src/rollup.rs), for the console's rules page: of the
-- decisions that checked the rule, how many it allowed and how many it refused (a shadow rule's
-- refusals among them: messages it would have refused, which were sent). Written by the same
-- batched writer as decision_rollup, one upsert a second; rows older than 30 days are deleted.
CREATE TABLE rule_verdicts (
    minute  TIMESTAMPTZ NOT NULL,
    rule    TEXT        NOT NULL,
    allowed BIGINT      NOT NULL,
    refused BIGINT      NOT NULL,
    PRIMARY KEY (minute, rule)
);
