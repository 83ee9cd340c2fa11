#!/usr/bin/env node
'use strict';
// Stream one completion to stdout:
//   node examples/stream.js [--target host:port] [--max-new-tokens N] [--temperature T] "prompt"
// Ctrl-C cancels the request on the server.

const { parseArgs } = require('node:util');
const { createClient, status } = require('..');

const { values: args, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    target: { type: 'string', default: process.env.ASYNCENGINE_TARGET ?? 'localhost:50051' },
    token: { type: 'string', default: process.env.ASYNCENGINE_TOKEN },
    tls: { type: 'boolean', default: false },
    'max-new-tokens': { type: 'string', default: '64' },
    temperature: { type: 'string', default: '0' },
  },
});
if (positionals.length !== 1) {
  console.error('usage: node examples/stream.js [--target host:port] [--max-new-tokens N] PROMPT');
  process.exit(2);
}

async function main() {
  const client = createClient(args.target, { token: args.token, tls: args.tls });
  const call = client.generateStream({
    text: positionals[0],
    sampling: { temperature: Number(args.temperature) },
    stopping: { maxNewTokens: Number(args['max-new-tokens']) },
  });
  process.once('SIGINT', () => call.cancel());
  try {
    for await (const response of call) {
      const event = response[response.event];
      if (response.event === 'delta') process.stdout.write(event.text);
      else if (response.event === 'finished') console.error(`\n[finished: ${event.reason}]`);
      else if (response.event === 'usage') {
        const { promptTokens, completionTokens, timeToFirstTokenS } = event;
        const ttft = `${(timeToFirstTokenS * 1000).toFixed(1)} ms to the first token`;
        console.error(`[${promptTokens} prompt + ${completionTokens} completion tokens, ${ttft}]`);
      }
    }
  } catch (err) {
    if (err.code !== status.CANCELLED) throw err;
    console.error('\n[cancelled]');
  } finally {
    client.close();
  }
}

main().catch((err) => {
  const message = err.code === undefined ? err.stack : `${status[err.code]}: ${err.details}`;
  console.error(`error: ${message}`);
  process.exit(1);
});
