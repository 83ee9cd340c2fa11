'use strict';
// Runs against a live server: ASYNCENGINE_TARGET=host:port npm test (with ASYNCENGINE_TOKEN and
// ASYNCENGINE_CONTROL_TOKEN for a server started with --auth-token / --control-auth-token).
// (tests/clients/test_node_client.py starts `asyncengine serve` on a tiny model and does this).

const { describe, test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { setTimeout: sleep } = require('node:timers/promises');
const { createClient, status } = require('..');

const target = process.env.ASYNCENGINE_TARGET;
const skip = target ? false : 'set ASYNCENGINE_TARGET=host:port of a running asyncengine server';

const GREEDY = {
  text: 'Hello, my name is',
  sampling: { temperature: 0 },
  stopping: { maxNewTokens: 24, ignoreEos: true },
};

/** Every response of a stream, in arrival order. */
async function collect(call) {
  const responses = [];
  for await (const response of call) responses.push(response);
  return responses;
}

/** Poll GetServerInfo until no request is running, waiting or swapped; return the last load. */
async function waitIdle(client, timeoutMs = 5000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const { load } = await client.serverInfo();
    const isIdle = load.running === 0 && load.waiting === 0 && load.swapped === 0;
    if (isIdle || Date.now() > deadline) return load;
    await sleep(50);
  }
}

describe('asyncengine client', { skip }, () => {
  let client;

  before(async () => {
    client = createClient(target, {
      token: process.env.ASYNCENGINE_TOKEN,
      controlToken: process.env.ASYNCENGINE_CONTROL_TOKEN ?? process.env.ASYNCENGINE_TOKEN,
    });
    await client.waitForReady(10_000);
  });

  after(() => client?.close());

  test('health, model and server info', async () => {
    assert.equal(await client.health(), 'SERVING');
    const model = await client.modelInfo();
    assert.ok(model.vocabSize > 0 && model.maxContextLength > 0, JSON.stringify(model));
    const server = await client.serverInfo();
    assert.equal(server.draining, false);
    assert.ok(server.version);
  });

  test('LoRA adapters: listed, refused without run-time updates, unknown by name', async () => {
    // the test server runs without --enable-lora: none are listed and none may be loaded
    assert.deepEqual((await client.listLoRAs()).adapters, []);
    await assert.rejects(client.loadLoRA({ loraName: 'sql', loraPath: '/adapters/sql' }), (err) => {
      assert.equal(err.code, status.FAILED_PRECONDITION);
      return true;
    });
    await assert.rejects(client.unloadLoRA('sql'), (err) => err.code === status.FAILED_PRECONDITION);
    const call = client.generateStream({ ...GREEDY, loraName: 'sql' });
    await assert.rejects(collect(call), (err) => {
      assert.equal(err.code, status.NOT_FOUND);
      assert.match(err.details, /'sql'/);
      return true;
    });
  });

  test('stream: Accepted, Deltas, Finished, Usage, and the text of unary Generate', async () => {
    const responses = await collect(client.generateStream(GREEDY));
    const events = responses.map((r) => r.event);

    assert.equal(events[0], 'accepted', events.join(' '));
    assert.deepEqual(events.slice(-2), ['finished', 'usage'], events.join(' '));
    const middle = events.slice(1, -2);
    assert.ok(middle.includes('delta'), events.join(' '));
    assert.ok(middle.every((e) => e === 'delta' || e === 'heartbeat'), events.join(' '));

    // Every message after Accepted is numbered 0, 1, 2, ... without gaps.
    const seqs = responses.slice(1).map((r) => Number(r[r.event].sequenceNumber));
    seqs.forEach((seq, i) => i === 0 || assert.equal(seq, seqs[i - 1] + 1, `sequence ${seqs}`));

    // Deltas tile the completion: each starts where the last one's tokens ended.
    const deltas = responses.filter((r) => r.event === 'delta').map((r) => r.delta);
    let numTokens = 0;
    for (const delta of deltas) {
      assert.equal(delta.sampleIndex, 0);
      assert.equal(delta.tokenOffset, numTokens);
      assert.ok(delta.completionTokens > numTokens);
      numTokens = delta.completionTokens;
    }
    const { accepted } = responses[0];
    const { finished } = responses.at(-2);
    const { usage } = responses.at(-1);
    assert.ok(accepted.requestId);
    assert.equal(finished.reason, 'LENGTH');
    assert.equal(numTokens, GREEDY.stopping.maxNewTokens);
    assert.equal(usage.completionTokens, GREEDY.stopping.maxNewTokens);
    assert.equal(usage.promptTokens, accepted.promptTokens);

    const [tokenized] = (await client.tokenize({ texts: [GREEDY.text] })).results;
    assert.equal(accepted.promptTokens, tokenized.tokenCount);

    const { results } = await client.generate({
      prompts: [GREEDY.text],
      sampling: GREEDY.sampling,
      stopping: GREEDY.stopping,
    });
    assert.equal(results.length, 1);
    assert.equal(results[0].finishReason, 'LENGTH');
    assert.equal(deltas.map((d) => d.text).join(''), results[0].text);
  });

  test('cancelling a stream mid-generation leaves nothing running', async () => {
    // No max_new_tokens: left alone this would run to the context limit.
    const call = client.generateStream({ text: 'Once upon a time', stopping: { ignoreEos: true } });
    let loadWhileRunning;
    await assert.rejects(
      async () => {
        for await (const response of call) {
          // deltas already buffered still arrive after cancel(): look at the load only once
          if (response.event !== 'delta' || loadWhileRunning !== undefined) continue;
          ({ load: loadWhileRunning } = await client.serverInfo());
          call.cancel();
        }
      },
      (err) => err.code === status.CANCELLED,
    );
    // The check below could not see a leak if the server did not count this request.
    const { running, waiting } = loadWhileRunning;
    assert.ok(running + waiting >= 1, JSON.stringify(loadWhileRunning));
    const load = await waitIdle(client);
    assert.deepEqual([load.running, load.waiting, load.swapped], [0, 0, 0], JSON.stringify(load));
  });

  test('Control.Abort ends a stream with Finished(CANCELLED), Usage and status OK', async () => {
    const requestId = `node-abort-${process.pid}-${Date.now()}`;
    const request = { text: 'Once upon a time', requestId, stopping: { ignoreEos: true } };
    const call = client.generateStream(request);
    const responses = [];
    for await (const response of call) {
      responses.push(response);
      if (response.event === 'delta' && responses.filter((r) => r.event === 'delta').length === 1) {
        const { abortedIds } = await client.abort(requestId);
        assert.deepEqual(abortedIds, [requestId]);
      }
    }
    assert.equal(responses[0].accepted.requestId, requestId);
    assert.deepEqual(responses.slice(-2).map((r) => r.event), ['finished', 'usage']);
    assert.equal(responses.at(-2).finished.reason, 'CANCELLED');
    assert.deepEqual((await client.abort([requestId])).abortedIds, []); // idempotent
    const load = await waitIdle(client);
    assert.deepEqual([load.running, load.waiting, load.swapped], [0, 0, 0], JSON.stringify(load));
  });
});
