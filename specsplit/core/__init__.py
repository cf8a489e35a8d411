"""Pure tensor algorithms (torch only): token trees and their growth, tree attention masks,
sampling, verification, the n-gram index and SpecPV's view maths. Nothing here knows about models,
engines or transports."""
